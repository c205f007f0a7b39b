//! Checks on the project itself rather than on the agent: the manual
//! (rendered config reference, links, the test command it names) and the
//! shape of the source and test trees (file lengths, no import loops).

mod docs;
mod layout;
