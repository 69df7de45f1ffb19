"""The gateway (data plane): an OpenAI-compatible request path to the replicas the plane
runs, routed from the folded log (`server.Gateway`; the rule is `services.core.routing`).

Nothing is imported here, so that the command line can read `listen`'s defaults without
loading the web server.
"""
