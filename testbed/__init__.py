"""Many local geotrain nodes behind emulated WAN links, with faults and an all-reduce baseline."""
