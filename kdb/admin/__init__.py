"""What the command line reports and repairs: read-only reports (report, explain,
info, integrity over tierfiles) and the commands that write (maintenance).
May import everything below the front ends; explain and info import back ends.
"""
