"""What the experiment commands share: flags of the engine (`engine_flags`), workloads, records and output checks
(`common`), the seeded prompt set and the model's answers to it (`answers`), the serving workload (`serving`), and the
profiler-trace reader (`trace_ops`). No flags are defined at import, except by `engine_flags.define()`."""
