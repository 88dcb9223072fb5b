"""Diagnosis: rules as data, evaluated over a capture into incidents with ranked causes."""
from .api import Diagnosis, diagnose
from .evaluate import Options
from .incident import Incident
from .rules import Rule, load_rules

__all__ = ["Diagnosis", "Incident", "Options", "Rule", "diagnose", "load_rules"]
