"""`kvfleet router`: an OpenAI-compatible reverse proxy in front of the engine replicas of one
InferenceDeployment. It finds the ready replicas (EndpointSlices, or a static list), reads each
one's load ten times a second, routes every request on prefix affinity and load, retries on
another replica before any byte reached the client, and holds requests while there is no
replica (scale from zero). Torch-free: it ships in the operator image.

    settings      RouterSettings, read once from the command line
    replicas      Replica (one engine: address, pod name, load, in flight) and ReplicaPool
    discovery     the pool's members: EndpointSlices (watch) or --backend URLs
    load          each replica's /metrics scraped at >= 10 Hz into its load
    prefix        block-aligned hashes of a request's prompt
    prefix_index  one replica's recently routed prefix blocks (LRU)
    strategies/   prefix (default), least-load, round-robin: one module each, one interface
    waiting       the bounded queue of requests waiting for a replica
    metrics       the router's Prometheus metrics
    proxy         one request: parse once, route, forward, retry, stream back
    upstream      one attempt at one replica over HTTP, within the upstream timeouts
    app           the aiohttp application and its lifecycle
    cli           `kvfleet router` flags
"""
