"""Actuators: what the controller scales. `local` (replica processes on this machine) and `kubernetes` (a Deployment)."""
