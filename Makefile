# The two commands of the README: `make demo` (main job on the embedded data) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test lint bench docs gpu-check

setup:
	bash scripts/setup.sh

demo: setup
	bash scripts/demo.sh $(ARGS)

test: setup
	$(PY) -m ruff check src tests bench scripts
	OMP_NUM_THREADS=1 $(PY) -m pytest -n 2

bench: setup
	$(PY) bench/step_cost.py

# The prepared GPU check (scripts/gpu-check.sh; README "On a GPU"): no set-up, runs from src/ with the
# machine's own PyTorch (a GPU machine reaches no registry); without a GPU it runs its CPU half.
OUT ?= gpu-check.txt
gpu-check:
	bash scripts/gpu-check.sh $(OUT)

# strict: a warning (an unresolved cross-reference, a page outside the nav) fails the build; --quiet would hide the
# warnings from strict mode's count, so the INFO lines stay
docs: setup
	$(PY) -m mkdocs build --strict
