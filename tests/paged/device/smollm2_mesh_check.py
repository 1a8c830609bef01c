"""Run by tests/paged/device/test_smollm2_mesh.py in a fresh process with 3 virtual CPU devices: the embedded
SmolLM2-135M (Q4_1 GGUF kept quantized; 3 KV heads) greedy on one device, with tp=3 and with dp=3, on the CPU's
default kernels (the native matmul and the native paged attention). Prints one JSON object.

On 2026-11-27 the first prompt's greedy output differed between one device and both meshes with the native attention
(" Paris.\n\nThe United States ..." against " Paris.\n\nThe answer is: 201") and this check ran XLA's attention; on
2026-11-28 all three agree with it (docs/sharding.md)."""

from __future__ import annotations

import json

import chex

chex.set_n_cpu_devices(3)

from models.loader import load_model  # noqa: E402
from paged import DynamicGenerator, SamplingSettings  # noqa: E402

PROMPTS = ["The capital of France is", "Write a haiku about the sea:"]


def main():
    model = load_model("smollm2-135m", quant="keep")
    out = {}
    for mesh in ("", "tp=3", "dp=3"):
        g = DynamicGenerator(model, mesh=mesh, max_batch_size=2, max_seq_len=256, max_chunk_size=64)
        out[mesh or "one"] = g.generate(PROMPTS, 12, gen_settings=SamplingSettings.greedy())
        if mesh == "tp=3":
            wo = g.engine.model.params.layers.wo
            out["tp=3 wo"] = [str(wo.values.sharding.spec), str(wo.scales.sharding.spec)]
    print("SMOLLM2_MESH " + json.dumps(out))


if __name__ == "__main__":
    main()
