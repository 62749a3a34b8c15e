"""`make setup`'s first check, run by the venv's own Python before anything is installed into it: one error line and
exit 1 when that Python is older than the project's floor (pyproject.toml's requires-python)."""

import sys

FLOOR = (3, 11)  # 3.10 reached its end of life in October 2026; PyAV 18 and binascii's strict_mode need 3.11

if __name__ == "__main__":
    if sys.version_info[:2] < FLOOR:
        sys.exit(f"error: unifiedserve needs Python >= {FLOOR[0]}.{FLOOR[1]}, .venv has {sys.version_info[0]}."
                 f"{sys.version_info[1]}; remove .venv and run make with PYTHON=python{FLOOR[0]}.{FLOOR[1]} (or newer)")
