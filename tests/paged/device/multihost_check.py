"""Run by tests/paged/device/test_multihost.py as two processes on localhost
(`python -m tests.paged.device.multihost_check PROCESS_ID NUM_PROCESSES PORT`), each with 2 virtual CPU devices,
joined by `paged.device.sharding.initialize_distributed`:
both run the same generator over a `dp=2,tp=2` mesh spanning all 4 devices, with the same jobs, the way a multi-host
user launches it. Each prints one JSON object of what it saw; the test compares them with each other and with one
device in its own process."""

from __future__ import annotations

import json
import sys

from models import ModelConfig
from models.loader import Model
from paged.testing import ByteTokenizer, tiny_model

TOK = ByteTokenizer()
CFG = ModelConfig(model_type="llama", vocab_size=258, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=8,
                  num_kv_heads=4, head_dim=16)
SETTINGS = dict(num_pages=40, page_size=8, max_batch_size=4, max_chunk_size=16, max_seq_len=96, max_penalty_range=0)
PROMPTS = ["the cat sat on the mat and then it sat again on the hat", "the cat sat on the mat and then it sat again",
           "hello world hello world", "zq"]


def model() -> Model:
    return tiny_model(CFG, seed=0, tokenizer=TOK, scale=0.08)


def run(mesh: str) -> tuple[object, dict]:
    """The generator on `mesh` with four jobs: greedy, seeded sampled, unseeded sampled (its seed drawn by the
    generator), and one more greedy sharing the first one's prefix. Returns the generator and the finished texts."""
    from paged import DynamicGenerator, Job, SamplingSettings
    from paged.testing import drain

    sampled = SamplingSettings(temperature=1.0, top_k=0, top_p=1.0, repetition_penalty=1.0)
    settings = [SamplingSettings.greedy(), sampled, sampled, SamplingSettings.greedy()]
    seeds = [None, 7, None, None]
    g = DynamicGenerator(model(), mesh=mesh, **SETTINGS)
    g.enqueue([Job(TOK.encode(p), 12, gen_settings=s, seed=seed, identifier=i)
               for i, (p, s, seed) in enumerate(zip(PROMPTS, settings, seeds, strict=True))])
    c = drain(g)
    g.pool.check({})
    return g, {str(i): f["full_completion"] for i, f in c.finals.items()}


def main():
    process_id, num_processes, port = (int(a) for a in sys.argv[1:4])
    from paged.device.sharding import initialize_distributed, is_main_process

    initialize_distributed(f"localhost:{port}", num_processes, process_id, local_cpu_devices=2)
    import jax

    from paged.errors import InvalidConfigError

    g, finals = run("dp=2,tp=2")
    mesh = g.engine.mesh
    k = g.engine.state.k
    try:
        run("tp=2")
        narrow = None
    except InvalidConfigError as e:
        narrow = str(e)
    out = {"process": jax.process_index(), "processes": jax.process_count(), "devices": len(jax.devices()),
           "local_devices": len(jax.local_devices()), "main": is_main_process(), "mesh": dict(mesh.shape),
           "mesh_processes": sorted({d.process_index for d in mesh.devices.flat}), "k_spec": str(k.sharding.spec),
           "k_local_shards": len(k.addressable_shards), "finals": finals, "narrow_mesh_error": narrow}
    print("MULTIHOST " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
