"""The fleet: several engine replicas on Ray Serve behind one ingress (`appliance serve --replicas N`).

Each replica (replica.py) runs the single-process server's own app (appliance.server.app) in
process; the ingress (ingress.py) forwards OpenAI requests through Ray Serve's DeploymentHandle
(its request router picks the replica) and fans the operator routes out to every replica through
the registry (registry.py). Only `appliance serve --replicas` imports this package, and with it Ray.
"""
