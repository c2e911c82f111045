"""The fleet page: a read-only web view of the fleet, served by `reconcile watch`.

    hub.py     what the running fleet run is doing, fed by the daemon (no web imports: cheap)
    view.py    PURE: store rows + the hub's snapshot -> the page's model (rollout, commits), and
               the words every section shares (a revision, an age, a phase)
    hosts.py   PURE: the same for the hosts: the grid (hosts x services) and one host's history
    app.py     the ASGI app (starlette): the routes, rendered in a thread of their own
    stream.py  the event streams: one render per change shared by all, a cap, what was refused
    server.py  the page served by uvicorn in the daemon's event loop (and /metrics, when the
               metrics share its address); app, stream and server are imported only when the page
               is on, so other `reconcile` runs never load them
    gate.py    limits on connections, idle and slow clients, in front of uvicorn's own protocol
               (the page's server and the metrics' own)
    peer.py    who a connection's client is (a local user by uid, a remote one by address)
    templates/ server-rendered HTML (Jinja2, autoescaped);  static/ the CSS and a little JS

Read-only: GET routes only, no form changes anything. Loopback by default (`web` in the
controller config, `reconcile watch --web`). Everything it shows passes through redact first.
"""
