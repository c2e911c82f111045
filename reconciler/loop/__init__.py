"""One host and the fleet: observe -> plan -> apply -> watch -> record, in rounds and rollout waves;
the host-side pre-flight (checks) and the run's report."""
