"""The device step: what runs on the accelerator and the engine that drives it.

`config` (EngineConfig) and `sharding` (meshes) at the bottom; `sampling`, `state` (EngineState, Batch, Results
pytrees), `batch` (rows -> a padded Batch), `step` (the jitted forward and sampler), `buckets` (the shape buckets),
`verify` (speculative verification), `engine_api` (the protocol an engine implements) and `engine` (the JAX Engine:
`run(rows) -> StepOutput`), `cpu_runtime` (CPU dispatch settings). Nothing here knows about jobs or scheduling."""
