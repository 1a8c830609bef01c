"""Re-exports of `paged.testing` (the fake engine and byte tokenizer live in the package, so code outside the
repository's tests can use them too)."""

from paged.testing import ByteTokenizer, Collected, FakeEngine, drain, fake_logprob, fake_top_k

__all__ = ["ByteTokenizer", "Collected", "FakeEngine", "drain", "fake_logprob", "fake_top_k"]
