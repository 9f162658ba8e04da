"""The vLLM integration suite (``make test-vllm``): skipped where vLLM or afd-plugin is not installed."""


def pytest_configure(config):
    config.addinivalue_line("markers", "vllm: needs vLLM 0.26.0 and afd-plugin installed (make test-vllm)")
