"""The running agent beside a server (`kvdoctor attach`): it runs the collectors (kvdoctor.collect),
writes the capture, diagnoses live, and serves /healthz, /metrics, /incidents and /report."""
