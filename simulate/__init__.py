"""``kvfabric sim``: what a KV-cache pool deployment will hit and cost, from a trace.

A discrete-event replay of a request trace over a simulated cluster (nodes, engines per
node, HBM / DRAM / SSD per node), using kvfabric's own block hashing
(``ucm_layer/hashing.py``) and the pool's own space and eviction code
(``pool/service/allocator.py``, ``pool/service/eviction.py``), timed by a calibration made
from ``kvfabric bench ... --json`` rows (docs/sim.md).

* ``config.py``     ClusterConfig, PriceTable, Calibration, SyntheticConfig (settings.py)
* ``trace.py``      Request; JSONL readers (token ids, block hashes, Mooncake FAST'25);
                    the synthetic generator (Zipf prefixes, length distributions, diurnal QPS)
* ``tiers.py``      Tier (one window: ExtentAllocator + LruByBytes), Node, the KV-event index
* ``routing.py``    round-robin and prefix-aware routers
* ``replay.py``     the event loop: arrivals, prefill starts, first tokens; Report
* ``sweep.py``      one capacity varied, the smallest sizing reaching a target, the plot
* ``calibrate.py``  a Calibration from bench JSON rows
* ``validate.py``   predicted against measured on a CPU vLLM engine with the connector
                    (its own trace, or ``kvfabric bench serve``'s workload)

Imports the pool's service-side allocator and eviction policy, ucm_layer's hashing and,
only inside ``validate``, the harness's engine and ``bench/serve_workload.py`` /
``bench/serve_worker.py`` (the serve workload, read, not changed); nothing imports this package.
"""
