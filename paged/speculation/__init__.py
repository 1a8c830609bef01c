"""Speculative decoding on the host: the drafters (`ngram` prompt lookup, `ngram_corpus` table, `draft` model), the
adaptive gate (`draft_gate`), their shared vocabulary (`rows`) and configuration (`config`: `SpeculationConfig`),
the `speculator` that drafts and accepts each step, and `spec_step`, the generator's side. Verification itself runs
on the device (`paged.device.verify`)."""
