"""Histogram buckets of a request's timings, the same on the worker's and the router's
/metrics (so their quantiles compare): time to first token, inter-token latency, queue time."""
TTFT_BUCKETS = (.001, .005, .01, .02, .04, .06, .08, .1, .25, .5, .75, 1, 2.5, 5, 7.5, 10,
                20, 40, 80)
ITL_BUCKETS = (.001, .0025, .005, .01, .015, .02, .025, .03, .04, .05, .075, .1, .15, .2, .3,
               .4, .5, .75, 1, 2.5)
QUEUE_BUCKETS = (.001, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120)
ITL_DOC = (" (each request's mean gap, weighted by its gaps: _sum / _count is the mean gap "
           "over every token)")
