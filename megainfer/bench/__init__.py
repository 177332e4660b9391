"""The arithmetic behind ``perf/``: how a result file is written and how measured runs are judged.

``perf/`` scripts run the measurements (mpiexec jobs, GPU benches); what they compute from the
numbers lives here so that tests can check it without importing a lab script:

* ``results_io``: ``write_json``, the one way a perf script writes its JSON;
* ``shapes``: the model shapes the benches run (``load_shape``: a ``conf/plan_model`` preset;
  ``BENCH50M``: ``conf/model/bench50m.yaml``'s arch);
* ``m2n_targets``: ``perf/bench/bench_m2n.py``'s targets (M2N vs MPI_Alltoallv, the A/A noise
  envelope);
* ``decode_roofline``: the HBM bytes of a decode step (``perf/bench/bench_gpu_engine.py``);
* ``kv_accuracy``: teacher-forced logits through a quantised KV cache and how far they move
  (``perf/bench/bench_kv_quant.py``);
* ``runtime_validation``: the performance model's decode iteration against recorded runtime runs
  (``perf/validate/validate_perfmodel.py``);
* ``sim_validation``: a runtime job's measured TTFT / TPOT / throughput and the host terms read
  off a traced run (``perf/validate/validate_sim.py``);
* ``pd_runs``: which recorded PD runs count as quiet and the machine's conditions per launch
  (``perf/validate/validate_sim_pd.py``);
* ``serve_load`` and ``serve_requests``: ``megainfer-bench-serve``, the serving benchmark's
  load generator and client (vLLM's ``bench serve``), kept out of the server package.
"""
