"""RoCE fabric checks: RDMA devices from sysfs, interfaces and peers through a netlink helper.

The long-lived agent never imports pyroute2 (about 22 MB): agent.fabric.probe does, in a
short-lived child process spawned per check. Nothing in this package imports the probe.
"""
