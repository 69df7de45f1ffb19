"""The running plane: what every plane process shares to follow the log, lead, and run.

- `follower`: a view kept current from the log (`ViewFollower`);
- `lease` and `leader`: one active scheduler (or preemption service) at a time, and the
  skeleton of a service that acts only while it leads;
- `liveness`: whether the plane runs, as a reader outside it can tell;
- `runner`: one service run as its own process (`python -m services.<service>`);
- `process` and `heap`: a plane process's own settings, and its heap kept out of the
  cyclic collector's reach.

Light on purpose: importing the package imports none of them (the CLI reads
`process.Config` for its help without a broker library).
"""
