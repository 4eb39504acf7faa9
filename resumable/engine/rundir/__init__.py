"""Who owns a run dir and which checkpoint a session starts from: opening the location (local or Drive), the
kernel lock and its owner record, ``resume_from`` (rewind), and the crash-loop check that refuses a start which would
fail the way the last ones did."""
