"""Test helpers: real llama.cpp and vLLM server harnesses (``llama_server``, ``vllm_server``, one
lifecycle in ``server_base``; the llama.cpp build and model cache in ``llama_build``), a streaming
load generator with client-side ground-truth timings (``loadgen``, its workloads in ``workloads``),
and simulators.

Nothing here is imported by ``kvdoctor`` itself; import the submodules you need.
"""
