"""The operator's commands besides ``edge-relay run`` (``edge_relay.cli`` dispatches them all).

- ``status``: link (and why it is down, or that the cloud stopped acking), backlog, drain rate and ETA,
  budget, losses and targets, from the spool file and the relay's ``/metrics``; ``statusview`` draws it
  (plain text, ``rich`` with ``--watch``, and the HTML of the relay's ``/status`` page).
- ``ledger``: the loss ledger: what was given up, when, and why.
- ``checkconfig``: ``check-config``, the same validation ``run`` does at start-up, and the config with
  every default filled in.
- ``budget_plan``: ``budget plan``, the offline estimate of each budget class's bytes per second.

Commands read the relay's files and endpoints; nothing in the relay's pipeline imports them, except
``app`` calling ``checkconfig.validate`` so that ``run`` and ``check-config`` refuse alike, and serving
``status.StatusPage`` on the metrics port so that the page and the command show the same status.
"""
