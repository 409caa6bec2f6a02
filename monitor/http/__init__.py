"""The monitor's HTTP face: the route-table server, the ops routes, the read API and the
control route."""
