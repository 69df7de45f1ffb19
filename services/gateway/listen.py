"""The gateway's defaults the CLI names in `--help`: constants of their own, so that the
command line need not import the web server to show them."""

DEFAULT_LISTEN = "127.0.0.1:8322"
"""Where `llmgw gateway` and `llmgw up` serve it by default: loopback, beside the
dashboard's 8321."""

# MAX_BODY is the largest request body taken (16 MiB): far past any chat a person
# writes, and small enough that a flood of them cannot take the gateway's memory.
MAX_BODY = 16 * 1024 * 1024
# BODY_BUDGET bounds the bytes of request bodies the gateway holds at once, all requests
# together (128 MiB: 8 bodies of MAX_BODY, or thousands of chats); past it a new body is
# 503 with Retry-After. A flood of large bodies then costs the gateway's process a
# bounded amount of memory rather than all of the host's.
BODY_BUDGET = 128 * 1024 * 1024
# UPSTREAM_TIMEOUT_S bounds each wait on a replica once connected: for its answer to
# begin, and between two chunks of a stream. A long generation streams; a replica
# silent this long is stuck (504, or the stream closed).
UPSTREAM_TIMEOUT_S = 300.0
# USED_INTERVAL_S is the least time between two `replica.used` the gateway publishes for
# one replica: the agents' default, so the log holds no more use reports with a gateway
# than without one.
USED_INTERVAL_S = 30.0
# QUEUE_PER_MODEL is how many requests one model may have waiting in the gateway (for a
# start, or for a slot on its busy replicas); past it a request is a 429 with when to
# come back.
QUEUE_PER_MODEL = 256
# KEEPALIVE_S is how often a held stream is sent an SSE comment (`: waiting`): under the
# 30 to 60 s after which proxies and load balancers cut a connection that says nothing.
KEEPALIVE_S = 10.0
# SHARE_INTERVAL_S is how often a gateway tells the others its load and the limits'
# shares it hands on (`services.gateway.share`); SHARE_EXPIRY_S how long one may be
# silent before its counts are dropped and its shares return (ten intervals).
SHARE_INTERVAL_S = 0.05
SHARE_EXPIRY_S = 0.5


def refusal(listen: str, no_auth: bool, keys: bool = False) -> str | None:
    """Why the gateway must not listen on `listen` (HOST:PORT), or None. Off loopback
    without API keys (`keys`) anyone who reaches the port could use every model, so that
    takes `no_auth` said out loud."""
    import ipaddress

    from services.listen import parse

    try:
        host, _ = parse(listen, DEFAULT_LISTEN)
    except ValueError as e:
        return str(e)
    if no_auth or keys or host == "localhost":
        return None
    try:
        if ipaddress.ip_address(host).is_loopback:
            return None
    except ValueError:
        pass
    return (
        f"{listen}: off loopback without --api-keys anyone who reaches the gateway could "
        "use every model; give --api-keys FILE, or --no-auth to serve it anyway"
    )
