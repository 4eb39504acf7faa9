"""Who owns a run dir and which checkpoint a session starts from: opening the location (local or Drive), the
kernel lock and its owner record, and ``resume_from`` (rewind)."""
