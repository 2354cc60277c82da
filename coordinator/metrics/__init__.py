"""Prometheus metrics of the coordinator (METRICS_LISTEN, path /metrics): one scrape target for the
whole cluster. The runtime's snapshot gives the phase and ranks, its journal events and incidents
drive the counters, the agents' status (polled) gives the node figures, and the memory guard's
samples give its margin."""
