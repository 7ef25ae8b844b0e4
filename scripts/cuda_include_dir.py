"""Print the include directory of the pinned nvidia-cuda-runtime wheel (the one holding cuda.h).

Used by CMake and by the test suite so that every C build sees the same CUDA headers.
Exit status 1 with a message on stderr when the wheel is not installed.
"""

import importlib.util
import pathlib
import sys


def cuda_include_dir() -> pathlib.Path:
    spec = importlib.util.find_spec("nvidia")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the nvidia-cuda-runtime wheel is not installed (no 'nvidia' package)"
        )
    for root in spec.submodule_search_locations:
        for sub in ("cu13/include", "cuda_runtime/include"):
            inc = pathlib.Path(root) / sub
            if (inc / "cuda.h").is_file():
                return inc
    raise FileNotFoundError("cuda.h not found in the nvidia-cuda-runtime wheel")


if __name__ == "__main__":
    try:
        print(cuda_include_dir())
    except FileNotFoundError as exc:
        print(f"cuda_include_dir: {exc}", file=sys.stderr)
        sys.exit(1)
