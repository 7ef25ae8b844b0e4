"""``python -m cuinterpose.agent.cli``: the same command line as ``cuinterpose-agent``."""

from cuinterpose.agent.cli import main

if __name__ == "__main__":
    main()
