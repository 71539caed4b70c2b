"""Deployment: one topology file rendered for Slurm, Kubernetes, compose and systemd (``resilient deploy``)."""
