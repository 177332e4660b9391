"""The arithmetic behind ``perf/``: how a result file is written and how measured runs are judged.

``perf/`` scripts run the measurements; what they compute from the numbers lives here, so tests
check it without importing a lab script. ``results_io`` (``write_json``, the one way a perf
script writes its JSON); ``shapes`` (the benches' model shapes: ``load_shape``, ``BENCH50M``);
``m2n_targets`` (``perf/bench/bench_m2n.py``'s targets); ``decode_roofline`` (a decode step's
HBM bytes, ``perf/bench/bench_gpu_engine.py``); ``kv_accuracy`` (logits through a quantised KV
cache, ``perf/bench/bench_kv_quant.py``); ``runtime_validation``, ``sim_validation``,
``pd_runs`` (the performance model and simulators against recorded runs, ``perf/validate/``);
``serve_load`` and ``serve_requests`` (``megainfer-bench-serve``, vLLM's ``bench serve``, kept
out of the server package). perf/README.md."""
