"""The cluster simulator: the real core in virtual time, with no broker and no sleeping.

Used by `llmgw simulate` and the simulator's tests and benchmark. `scenario` reads a
scenario file (nodes, models, quotas, demand), `engine` runs it under one preemption
policy (the fold, the scheduler's pass, the policy and its reactions and the hold rule,
the same calls the services make) and writes the simulated log as a bundle, `report`
sums what happened, and `oracle` says whether a `no_fit` was needless. Time is a
number of seconds the engine advances itself; no asyncio, no broker, no clock. The only
I/O is reading a scenario file (`scenario.load`) and writing to the bundle the caller
hands in.
"""
