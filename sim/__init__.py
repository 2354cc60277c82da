"""dsv41-sim-rank: a stand-in for an SGLang rank in tests and the local demo.

No model and no GPU: it parses SGLang's argv, forms the TP group over TCP like torch.distributed's
rendezvous, and on rank 0 serves the HTTP API the coordinator and the memory guard use, with a
prefill that allocates real memory. Never the default engine (cluster.env RANK_ENGINE=sim).
"""
