"""PURE: what a host says (facts), what the reconciler keeps there (records), and every decision:
states, actions, rendered files and diffs, the dead-man's switch, rollout waves. No I/O, no clock."""
