"""The serving benchmark's pieces (`experiments/bench_serving.py` is the command-line wrapper): seeded workloads and
arrival schedules (`workloads`), the host loop over a DynamicGenerator-like object (`runner`), vLLM-style metrics
(`metrics`), hardware probes and utilisation estimates (`hardware`), run environment (`env`) and plots (`plots`)."""
