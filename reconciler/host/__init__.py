"""The only code that talks to a host or the network: the SSH transport, the lock and its session,
the executor (apply), health watches and probes, the GPU gate's readings, webhooks."""
