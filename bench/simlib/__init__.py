"""Discrete-event cluster simulator for the scheduler (bench/sim.py). It drives the very
SchedulerCore the service runs (services.scheduler.core) over simulated inference instances."""
