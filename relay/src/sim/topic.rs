//! An in-memory Kafka topic for the simulator: one partition that outlives
//! relay and applier crashes (it is the broker's), a consumer group offset
//! stored with it, and a seeded fault - a batch that fails after part of it
//! landed. It is both the publisher's [`Producer`] and the applier's
//! [`Records`], so the real publisher and applier run against it.

use crate::transport::kafka::Producer;
use crate::transport::{RecordReader, Records, TransportError};
use std::cell::{Cell, RefCell};

#[derive(Debug, Default)]
pub(crate) struct SimTopic {
    pub records: RefCell<Vec<(u64, Vec<u8>)>>,
    /// The applier group's committed offset.
    group: Cell<u64>,
    /// The n-th batch fails after its first half landed.
    pub fail_batch: Option<u32>,
    batches: Cell<u32>,
    pub fired: Cell<u32>,
}

impl SimTopic {
    /// A topic whose `fail_batch`-th batch fails half-landed.
    pub fn failing_at(fail_batch: Option<u32>) -> Self {
        SimTopic {
            fail_batch,
            ..SimTopic::default()
        }
    }
}

impl Producer for &SimTopic {
    async fn send_batch(&self, records: &[(u64, Vec<u8>)]) -> Result<(), TransportError> {
        self.batches.set(self.batches.get() + 1);
        if self.fail_batch == Some(self.batches.get()) {
            self.fired.set(self.fired.get() + 1);
            let landed = records.len() / 2;
            self.records
                .borrow_mut()
                .extend(records.iter().take(landed).cloned());
            return Err(TransportError::Simulated(
                "broker: connection lost before every record was acknowledged".into(),
            ));
        }
        self.records.borrow_mut().extend(records.iter().cloned());
        Ok(())
    }
}

#[derive(Debug)]
pub(crate) struct TopicReader<'a> {
    topic: &'a SimTopic,
    next: u64,
}

impl RecordReader for TopicReader<'_> {
    fn next_record(&mut self) -> Result<Option<crate::log::Record>, TransportError> {
        let records = self.topic.records.borrow();
        let Some((commit_lsn, payload)) = records.get(self.next as usize) else {
            return Ok(None);
        };
        let record = crate::log::Record {
            offset: self.next,
            commit_lsn: *commit_lsn,
            payload: payload.clone(),
        };
        self.next += 1;
        Ok(Some(record))
    }

    fn next_offset(&self) -> u64 {
        self.next
    }
}

impl Records for SimTopic {
    type Reader<'a> = TopicReader<'a>;

    fn start(&self, _consumer: &str) -> Result<u64, TransportError> {
        Ok(self.group.get())
    }

    fn read_from(&self, offset: u64) -> Result<TopicReader<'_>, TransportError> {
        Ok(TopicReader {
            topic: self,
            next: offset,
        })
    }

    fn applied(
        &self,
        _consumer: &str,
        offset: u64,
        _commit_lsn: u64,
    ) -> Result<(), TransportError> {
        self.group.set(offset + 1);
        Ok(())
    }
}
