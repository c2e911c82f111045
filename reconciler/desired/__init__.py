"""git at a revision -> the desired state of every host (source, schema, load, spec, secrets, trust);
never a host: nothing here opens a connection."""
