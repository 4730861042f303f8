"""The operator's view of the gateway: the live dashboard and the autoscaling gauges.

fleet      FleetGauges: the capacity registry and the queue, as /metrics gauges
recent     RecentErrors: a bounded ring of the gateway's 5xx answers (and its middleware)
handlers   Dashboard: the static page (index.html, app.js, style.css) and its admin JSON
"""

from gateway.dashboard.fleet import FleetGauges, FleetSnapshot, ModelLoad, model_loads
from gateway.dashboard.handlers import Dashboard
from gateway.dashboard.recent import RecentErrors, RecentErrorsMiddleware

__all__ = [
    "Dashboard",
    "FleetGauges",
    "FleetSnapshot",
    "ModelLoad",
    "RecentErrors",
    "RecentErrorsMiddleware",
    "model_loads",
]
