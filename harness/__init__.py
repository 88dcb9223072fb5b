"""Test helpers: real llama.cpp and vLLM server harnesses (``llama_server``, ``vllm_server``, one
lifecycle in ``server_base``; the llama.cpp build and model cache in ``llama_build``), a streaming
load generator with client-side ground-truth timings (``loadgen``, its workloads in ``workloads``),
and simulators.

A dev package at the top of the checkout, beside ``kvdoctor/``: not in the wheel, and never
imported by ``kvdoctor`` itself (tests/test_packaging.py and the import-linter contracts check
both). Tests, benchmarks and scripts import it from the checkout (pytest's ``pythonpath``; the
scripts put the checkout root on ``sys.path``); its command lines run from the checkout root, as
``python -m harness.scenarios``. Import the submodules you need.
"""
