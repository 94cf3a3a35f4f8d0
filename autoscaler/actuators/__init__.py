"""Actuators: what the controller scales; `local` (replica processes on this machine), `kubernetes` (a Deployment)."""
