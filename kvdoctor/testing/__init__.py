"""Test helpers: a real llama.cpp server harness (``llama_server``), a streaming load
generator with client-side ground-truth timings (``loadgen``), and simulators.

Nothing here is imported by ``kvdoctor`` itself; import the submodules you need.
"""
