"""cluster: Ray Serve deployments (ingress, router, worker pools), KV transfer, autoscaling and the
`cluster.app:deployment` builder. Built in a later slice (issue 4); empty until then.
"""
