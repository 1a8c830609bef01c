"""Fixtures of the experiment scripts' tests."""

from __future__ import annotations

import pytest
from absl import flags


@pytest.fixture
def cp():
    """experiments.compare_policies (imported when a test asks: its flags join absl's then), flags reset after."""
    from experiments import compare_policies

    yield compare_policies
    flags.FLAGS.unparse_flags()
