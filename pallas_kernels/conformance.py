"""The kernel conformance suite as pytest tests: every case of `pallas_kernels.testing` against each implementation
the `--kernel` option names (see `pallas_kernels.pytest_plugin`; default: the built-ins "xla" and "pallas").

    python -m pytest --pyargs pallas_kernels.conformance --kernel=my_module:my_attention --kernel-level=full

Registration (signature and output shape, traced on a small case) is its own test, so a wrong signature fails
there with the registry's message.
"""

from __future__ import annotations

import pytest

from pallas_kernels import testing
from pallas_kernels.pytest_plugin import kernels_under_test
from pallas_kernels.registry import attention_registry, matmul_registry


def _registry(family: str):
    return attention_registry() if family == "attention" else matmul_registry()


def pytest_generate_tests(metafunc):
    if "kernel" not in metafunc.fixturenames:
        return
    config = metafunc.config
    level = config.getoption("kernel_level")
    want = metafunc.function.__name__.split("_")[1]  # test_attention_* / test_matmul_* / test_registers_*
    params, ids = [], []
    for family, name in kernels_under_test(config):
        if want == "registers":
            params.append((family, name, None))
            ids.append(f"{family}-{name}")
            continue
        if family != want:
            continue
        cases = testing.attention_cases(level) if family == "attention" else testing.matmul_cases(level)
        for case in cases:
            params.append((family, name, case))
            ids.append(f"{name}-{case.name}")
    metafunc.parametrize("kernel", params, ids=ids)


@pytest.fixture
def tuning(request, kernel):
    text = request.config.getoption("kernel_tuning")
    family, name, _ = kernel
    return _registry(family).parse_tuning(name, text)


def test_registers_against_the_contract(kernel):
    family, name, _ = kernel
    reg = _registry(family)
    impl = reg.get(name)  # imports and checks a module:function path
    reg._check(impl)


def test_attention_matches_the_reference(kernel, tuning):
    _, name, case = kernel
    reason = testing.native_gpu_skip_reason(name, case)
    if reason:
        pytest.skip(reason)
    testing.check_attention(name, case, tuning=tuning)


def test_matmul_matches_the_oracle(kernel, tuning):
    _, name, case = kernel
    testing.check_matmul(name, case, tuning=tuning)
