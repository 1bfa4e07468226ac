"""One rank's training job (``loop``) and its records (``metrics``)."""
