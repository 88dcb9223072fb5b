"""`kvdoctor oncall`: Alertmanager webhooks in, diagnosed on-call summaries out (docs/oncall.md)."""
