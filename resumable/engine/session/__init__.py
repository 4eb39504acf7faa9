"""One session in its process (a script, or a notebook kernel that outlives it): the open runs and how a loop was
left, the same fresh start on every run of a cell, the code identity, the crash-loop check and the session's end."""
