"""The checkpoint and restore sequences: step tables, the step runner, interrupts, progress."""
